"""The worker processes: their pool, their wire protocol, and what runs inside them."""
