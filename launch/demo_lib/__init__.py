"""Helpers of ``launch/demo.py``: each module has one job (stack commands, process supervision, load,
signal collection, live view, verdict, report). They talk to the project only through its entry points
as processes, files and HTTP, never through component internals."""
