"""Workarounds that let vLLM's engines and NixlConnector run well on small CPU hosts; inert on GPU hosts.

Each one is listed, with the versions it targets, its measured reason and when it can go, in this folder's
README.md and in docs/workarounds.md. Nothing is imported here: vLLM loads ``shm_wait`` as a plugin in every
process, and the connector module imports vLLM.
"""
