"""What each step of the game plan does: one function per registry row (its `fn`), grouped by
family (data, compare, train, eval, curves, decision, report, online, publish); each reads its
named inputs and params from a pipeline.runner.StepContext and returns its metrics."""
