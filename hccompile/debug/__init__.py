"""Debugging: per-pass dumps, reports, depyf integration. (`hccompile.explain`, which compiles a
model to get its report, is a level above: hccompile/explain.py.)"""
from .report import GraphReport, PassRecord, Report

__all__ = ["GraphReport", "PassRecord", "Report"]
