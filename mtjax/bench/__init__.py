"""`mtjax bench`: timings of fused ops and train steps against XLA/Flax peers."""
