"""The wire protocol between the server and its agents: frames, codecs, triples, work packets.

Django-free and imported by both sides (the agent process and the server); it imports
nothing of the server and nothing of the agent process (an import-linter contract in
pyproject.toml keeps it so).
"""
