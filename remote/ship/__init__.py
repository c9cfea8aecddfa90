"""The outputs shipper a run's supervisor starts (``python3 -m remote.ship.shipper``).
"""
