"""spark-guard: keeps the rescue window open on unified-memory model-serving machines."""

__version__ = "0.5.0"
