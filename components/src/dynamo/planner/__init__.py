"""The planner: FPM streams -> pure scaling policy -> connectors. See docs/planner.md."""
