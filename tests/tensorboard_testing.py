"""Reading TensorBoard event files back, as TensorBoard itself reads them (its ``EventAccumulator``)."""
from pathlib import Path
from typing import Dict, List, Tuple

from tensorboard.backend.event_processing import event_accumulator


def scalars(logdir: Path) -> Dict[str, List[Tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every TensorBoard event file under ``logdir``."""
    found: Dict[str, List[Tuple[int, float]]] = {}
    for events_file in sorted(logdir.rglob("events.out.tfevents.*")):
        accumulator = event_accumulator.EventAccumulator(str(events_file))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found.setdefault(tag, []).extend((event.step, event.value) for event in accumulator.Scalars(tag))
    return found
