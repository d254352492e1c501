"""Cached model features (image and language); lands with issue #3."""
