"""Adapters that plug tieredkv into serving engines. Each submodule imports its engine lazily."""
