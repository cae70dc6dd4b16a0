"""The GPU fast path: packed-weight model runner, paged KV and state pools, memory plan."""
