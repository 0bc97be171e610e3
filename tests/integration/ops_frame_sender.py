"""A producer stand-in for the kill test: streams the first N frames of a recorded request to a
consumer, says SENT, then waits to be killed (SIGKILL) mid-stream. Imports only grpc and the
generated protocol, so it starts in about a second.

    python ops_frame_sender.py ADDRESS TOKEN FRAMES_FILE N
"""

import struct
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc  # noqa: E402

from shared.rpc import scd_pb2 as pb  # noqa: E402
from shared.rpc import scd_pb2_grpc as pbg  # noqa: E402


def frames(path: Path) -> list[pb.KVFrame]:
    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        out.append(pb.KVFrame.FromString(data[i + 4 : i + 4 + n]))
        i += 4 + n
    return out


def main() -> None:
    address, token, path, n = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    fs = frames(path)[:n]
    forever = threading.Event()

    def gen():
        yield from fs
        print("SENT", flush=True)
        forever.wait()

    with grpc.insecure_channel(address) as ch:
        for _ in pbg.ConsumerStub(ch).Transfer(gen(), metadata=(("authorization", f"Bearer {token}"),)):
            pass


if __name__ == "__main__":
    main()
