"""Kept for tools that still call setup.py; all metadata is in setup.cfg."""

from setuptools import setup

setup()
