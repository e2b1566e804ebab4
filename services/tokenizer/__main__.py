import os

# Accepted connections get gRPC's poller-driven endpoints: the server's polling thread reads and
# writes the socket itself. With the EventEngine listener (grpcio's default) three more threads
# wake on every call to do that; on a 2-core VM that costs ~0.1-0.2 ms of each call's latency
# (bench/tokenizer.py). grpc reads this once, when it is imported, so it is set here, first; an
# operator's own GRPC_EXPERIMENTS wins.
os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_listener")

from services.tokenizer.main import main  # noqa: E402

raise SystemExit(main())
