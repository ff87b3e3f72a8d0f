"""Tests through the local rehearsal: whole runs on one machine, faults included."""
