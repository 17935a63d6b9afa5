"""The planner on Dynamo's fleet simulator: ``python -m dynamo.planner simulate``.

See docs/planner-evaluation.md.
"""
