"""Task suites: the task model, the suite formats (native, ClawGym-Bench, PinchBench, built-in CPU), the catalog
that resolves suite specs, and the grading rules (how a grader is invoked and its output read).

Topics: none (pure; the sandbox worker and the scheduler use it). Run: ``python -m producers.tasks list SPEC`` lists a
suite's tasks (``--export DIR`` writes them in the native format), ``python -m producers.tasks show TASK`` shows one
(grading a workspace runs in a sandbox: ``clawstream tasks grade``).
"""
