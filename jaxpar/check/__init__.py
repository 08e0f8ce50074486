"""`jaxpar check`: every kernel's door against its reference, a train step, a decode step and
the collectives, timed against the device's peak, on whatever hardware this process finds."""
