"""Measuring drafters: offline accept length (accept), the drift probe (drift), the serving cost
model (costmodel), the decision with its bootstrap CIs (decision), the adaptive data budget's rule
(budget), the hours (hours), and the engines' own figures: vLLM serving a drafter next to the
offline evaluator (online) and speculators' forward of a published one (roundtrip)."""
