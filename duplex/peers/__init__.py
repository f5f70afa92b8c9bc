"""Faithful simulators of the peers our transports talk to (Twilio, Asterisk, ...), for tests and benchmarks."""
