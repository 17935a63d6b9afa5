"""Stand-in for ``aisimulate_core`` (NOT the real package).

Our own minimal module, written only so that upstream Dynamo 1.6.1's planner modules import in
``.cache/upstream-planner/venv``; the real ``aisimulate_core`` is not on the package index.
Load-based scaling never calls into it. The names defined here raise as soon as they are used,
so a configuration that needs the real AISimulate perf model fails loudly.
"""
