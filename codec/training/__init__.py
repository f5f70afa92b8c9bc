"""Training-side code for the speech codec: the hibari teacher, the training recipe and its evaluation.

Nothing at run time imports this package; `codec.speech_codec`, `codec.fsq` and `codec.dsp_vocoder`
stand alone (torch + numpy).
"""
