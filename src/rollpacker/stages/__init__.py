"""One RL step as stages: the only implementation of a step.

    plan -> [profile] -> rollout -> reward, judge -> train -> commit       (run.run_step)

Each stage is a function of a ``StageContext`` and the typed messages of the stages before it
(``stages.messages``). The KFP components call them through ``stages.edge`` (JSON in and out, one
stage per task, services in Ray); ``rollpacker train``, ``run --runner inline`` and ``bench
learning`` call ``run_step`` in one process (services in-process). Heavy work happens in the
services; a stage tells them what to do and reports what they did. The committed state in the
object store is the only thing carried between steps.
"""
