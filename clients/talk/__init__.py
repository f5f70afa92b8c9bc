"""`duplex talk`: a conversation with the service from a terminal (microphone and loudspeaker), or
from a wav file. A thin client of the native protocol: the server decides turns, barge-in and what
was heard. Start at cli.py; live.py and file_mode.py are the two modes (docs/talk.md)."""
