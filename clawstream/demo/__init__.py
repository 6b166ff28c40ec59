"""The CPU quickstart (``make demo`` / ``clawstream demo``): the whole training loop on one laptop-class machine.

1. start (or reuse) the local Apache Kafka broker and create the topic catalog under a fresh per-run prefix;
2. build the tiny Qwen3-architecture policy (once; cached) and warm-start it by SFT with a step-bounded, seeded
   recipe (``warmstart.sft``; once per recipe, cached), with a progress bar;
3. start the services as separate processes, exactly as an operator would: inference engine (vLLM protocol),
   serving proxy, sandbox worker, Faust stream processors, learner, scheduler (``clawstream.stack.services``);
4. train ``steps`` RL steps mixing harnesses (default the two built-in ones, ``agentloop`` over OpenAI Chat and
   ``agentloop-anthropic`` over Anthropic Messages; ``--harnesses`` names others, real ones included, ``state``) on
   the built-in CPU task suite, showing a progress bar of each
   step's rollouts and, per step, the reward per harness, the policy-gradient loss, clipped fraction, mean IS weight,
   KL of the update, entropy and tokens/s (``watch``), and each weight version as the engine starts serving it;
5. stop the services and read back from the event log where each step's time went (``timeline``);
6. evaluate the warm start and the final policy on held-out tasks, per harness, greedy and sampled, with standard
   errors (``clawstream.stack.evaluate``; the warm start's result is cached per model and config), and print the
   before/after table; write the plot ``learning.png``, TensorBoard scalars and ``summary.json`` (``report``).

Everything lands in ``$CLAWSTREAM_HOME/demo/<run>/``: ``logs/`` (one per service), ``weights/``, ``tensorboard/``,
``final-model/``, ``eval-before/``, ``eval-after/``, ``timeline.md``, ``before_after.md``, ``learning.png``,
``summary.json`` (rewritten as results arrive), ``state.json`` (for ``--resume``). Topics: the whole catalog under the
run's prefix (``demo-<run>.``), evaluations under their own. Modules: ``run`` (the sequence above, a function per
phase), ``config`` (the sizes and their check), ``models`` (the warm start, the exported final policy), ``watch`` (live
output), ``report`` (table, plot, TensorBoard), ``timeline``, ``costs`` (per harness), ``state`` (harnesses, resume).
"""

from clawstream.demo.config import DemoConfig
from clawstream.demo.run import run_demo

__all__ = ["DemoConfig", "run_demo"]
