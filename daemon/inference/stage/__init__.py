"""A stage: the pure core that schedules its requests' steps (`core`, `state`, `admission`,
`drafting`), the MLX engine that runs them (`engine`, `model`, `shard`), and the asyncio
runtime around the core (`runtime`). Imports transport and the shared modules only."""
