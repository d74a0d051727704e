"""The SDK's name and version as reported in Hello (kept in sync with pyproject.toml)."""

SDK_NAME = "durable-executor-python"
__version__ = "0.1.0"
