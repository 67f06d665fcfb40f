"""The third stage of a bucket's pipeline, the all-gather that brings the updated slices back into the
flat parameter buffer: started after the bucket's update and finished where its parameters are read
next, one pair in gather.py (BucketGather), and one optimizer's gather of a bucket it shares with others
(packed.py).

It stands just above comm/: it reads a bucket's layout and parameter buffer, handed to it, and nothing
else of buckets/, whose resharding must finish a gather before it moves the parameters.

May import comm/ only; not buckets/, reducing/, updating/, step_end/ nor the engine's modules above them."""
