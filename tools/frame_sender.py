"""A producer stand-in for ``scd soak --faults``: streams recorded frames to a consumer, says SENT,
then waits to be killed (SIGKILL) mid-stream; a call that fails first prints its status code (lower
case). Imports only grpc and the generated protocol, so it starts in about a second.

    python tools/frame_sender.py ADDRESS FRAMES_FILE [N [TOKEN]]

N: send the first N frames only; TOKEN: the consumer's bearer token. The frames file holds each frame
as a 4-byte little-endian length and its bytes. tests/integration/test_faults.py uses it too.
"""

import struct
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from shared.rpc import scd_pb2 as pb  # noqa: E402
from shared.rpc import scd_pb2_grpc as pbg  # noqa: E402


def main() -> None:
    address, path = sys.argv[1], Path(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else None
    md = (("authorization", f"Bearer {sys.argv[4]}"),) if len(sys.argv) > 4 else None
    data, frames, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        frames.append(pb.KVFrame.FromString(data[i + 4 : i + 4 + n]))
        i += 4 + n
    frames = frames[:n]
    forever = threading.Event()

    def gen():
        yield from frames
        print("SENT", flush=True)
        forever.wait()

    with grpc.insecure_channel(address) as ch:
        try:
            for _ in pbg.ConsumerStub(ch).Transfer(gen(), metadata=md):
                pass
        except grpc.RpcError as e:  # the consumer refused or is gone (restarting): said, as the soak counts it
            print(e.code().name.lower(), flush=True)


if __name__ == "__main__":
    main()
