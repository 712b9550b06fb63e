"""Reading TensorBoard event files back, with tensorboardX's protobufs (no TensorFlow, no tensorboard)."""

import glob
import os
import struct

from tensorboardX.proto import event_pb2


def _records(path):
    """The payloads of a TFRecord file: ``[u64 length][u32 crc][payload][u32 crc]`` each."""
    with open(path, "rb") as f:
        data = f.read()
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        offset += 12
        yield data[offset:offset + length]
        offset += length + 4


def scalars(logdir):
    """``{tag: {step: value}}`` of the event files in ``logdir``, oldest file first; a session start at
    step ``s`` (a resumed run's ``purge_step``) drops the earlier files' values from step ``s`` on, as
    TensorBoard does."""
    found = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        for payload in _records(path):
            event = event_pb2.Event.FromString(payload)
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                for values in found.values():
                    for step in [s for s in values if s >= event.step]:
                        del values[step]
            for value in event.summary.value:
                found.setdefault(value.tag, {})[event.step] = value.simple_value
    return found
