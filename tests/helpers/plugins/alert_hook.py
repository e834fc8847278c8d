"""A --trace-detect-hook for the tests: appends each alert (window, iterations, the line, the suspects' ranks)
as one JSON line to the file named by $MEGASCAN_ALERT_FILE."""

import json
import os


def record(alert):
    with open(os.environ["MEGASCAN_ALERT_FILE"], "a") as alerts:
        alerts.write(json.dumps({"window": alert.window, "iterations": alert.iterations, "line": alert.line,
                                 "suspects": [suspect.rank for suspect in alert.report.suspects]}) + "\n")
