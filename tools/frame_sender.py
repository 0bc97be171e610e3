"""A producer stand-in for ``scd soak --faults``: streams recorded frames to a consumer, says SENT,
then waits to be killed (SIGKILL) mid-stream; a call that fails first prints its status code (lower
case). Imports only grpc and the generated protocol, so it starts in about a second.

    python tools/frame_sender.py ADDRESS FRAMES_FILE
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
    data, frames, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        frames.append(pb.KVFrame.FromString(data[i + 4 : i + 4 + n]))
        i += 4 + n
    forever = threading.Event()

    def gen():
        yield from frames
        print("SENT", flush=True)
        forever.wait()

    with grpc.insecure_channel(address) as ch:
        try:
            for _ in pbg.ConsumerStub(ch).Transfer(gen()):
                pass
        except grpc.RpcError as e:  # the consumer refused or is gone (restarting): said, as the soak counts it
            print(e.code().name.lower(), flush=True)


if __name__ == "__main__":
    main()
