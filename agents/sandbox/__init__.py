"""Running tenant code: archive extraction, the package cache, the task runner and its children.

Django-free and imported by both the agent process and the server's in-process executor;
it imports nothing of the server and nothing of the agent process (an import-linter
contract in pyproject.toml keeps it so).
"""
