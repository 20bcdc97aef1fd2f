"""Embedded configuration files (package data)."""
