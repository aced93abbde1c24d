"""What every subsystem runs on: the trio/asyncio bridge, notification, events, BLAS, imports."""
