"""The round: the anyio engine, its slots, the request plan, the round planner and the scheduler step. The top of the core."""
