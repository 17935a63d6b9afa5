"""The planner on Dynamo's fleet simulator: ``python -m dynamo.planner simulate`` (docs/planner-evaluation.md)."""
