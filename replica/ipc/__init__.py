"""The boundary between the front and the engine-core process: a length-prefixed frame
socket (channel.py) and the typed, batched messages that cross it (messages.py). Both sides
import this package; nothing in it knows either side's internals."""
