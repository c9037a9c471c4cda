"""Debugging: per-pass dumps, reports, depyf integration."""
from .explain import explain
from .report import GraphReport, PassRecord, Report

__all__ = ["explain", "GraphReport", "PassRecord", "Report"]
