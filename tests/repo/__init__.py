"""Checks of the repository as a whole: docs and architecture true to the code, import
layers, packaging and extras, tier markers, CLI consistency, OpenAPI documents."""
