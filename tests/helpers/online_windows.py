"""What --trace-detect's judge sees of a trace directory: every rank's summary of each window, as the ranks gather
them during the run (megascan.online_detection.summarize)."""

import json

from megascan.online_detection import summarize


def window_summaries(directory):
    """[every rank's summary of window w] for each window of the trace files in ``directory``, in order."""
    by_window = {}
    for path in sorted(directory.glob("benchmark-data-*.json")):
        metadata, *windows = (json.loads(line) for line in path.read_text().splitlines())
        for line in windows:
            by_window.setdefault(line["window"], []).append(summarize(metadata, line))
    return [by_window[window] for window in sorted(by_window)]
