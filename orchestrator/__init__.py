"""dfo: drive rented GPU nodes over plain SSH (the controller side)."""

__version__ = "0.1.0"
