"""Pure partitioner: mesh graph + model description in, plan out. No I/O."""
