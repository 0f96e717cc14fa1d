"""What makes docs pages (models_page: docs/models.md; page_shots: the page's screenshots) and
the embedded default model (train_default), run as python -m tests.tools.NAME."""
