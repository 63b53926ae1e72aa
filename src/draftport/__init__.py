"""draftport: port an EAGLE-3 drafter to a new version of its target model, as a tracked game plan
(docs/architecture.md: which module holds what)."""
