"""Workarounds for the Dynamo runtime (ai-dynamo-runtime) as this project runs it.

Each one is listed, with the versions it targets, its measured reason and when it can go, in this folder's
README.md and in docs/workarounds.md.
"""
