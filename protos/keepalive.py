"""gRPC keepalive for the long-lived streams routers hold to every replica (WatchLoad,
WatchKVEvents): one place for the client's pings and the server's permission to receive them.

Without pings a half-open connection (a partition, a NAT or conntrack idle timeout, a paused
VM) never fails a read: the router kept routing on the last load it saw and, worse, on a prefix
index frozen at the last KV event, since an idle replica's KV stream is silent anyway. With
them a dead peer fails the stream within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS, and the
subscription reconnects and resyncs from a snapshot. The server must accept pings that often,
with or without data in flight, or gRPC answers them with GOAWAY (too_many_pings)."""

KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000

CLIENT_KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # an idle KV stream sends no data between pings
)
SERVER_KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
)
