"""A project-scoped coding agent driven by a local model: it reads, searches, edits and runs
commands inside one project folder through a small set of tools (``tools/``), under a safety
policy (``policy``) that keeps every path inside the project and asks before risky actions;
sessions are stored so they resume, and a tool loop connects the model to the tools.
"""
