"""The comparison page: one data document built from the store (runs, registry, sweeps),
rendered into a self-contained HTML file or served by `trainyard ui`. No Prefect here."""

from trainyard.report.data import RecordCache, ReportData, build_report_data
from trainyard.report.page import data_json, render_page
from trainyard.report.server import make_server

__all__ = [
    "RecordCache",
    "ReportData",
    "build_report_data",
    "data_json",
    "make_server",
    "render_page",
]
