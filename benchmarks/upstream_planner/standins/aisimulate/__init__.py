"""Stand-in for ``aisimulate`` (NOT the real package).

Our own minimal module, written only so that upstream Dynamo 1.6.1's planner and replay
modules import in ``.cache/upstream-planner/venv``. The real ``aisimulate==0.13.0`` does not
install without ``nvidia-smi``. Load-based scaling never calls into it; every function here
raises if it is ever reached, so a run that needed the real package fails loudly instead of
producing numbers.
"""
