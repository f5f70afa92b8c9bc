"""Audio conventions every layer shares."""

#: every stage (VAD, ASR) takes 16 kHz mono float32; transports resample to and from it
SAMPLE_RATE = 16000
