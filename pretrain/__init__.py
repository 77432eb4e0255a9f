from pretrain.third_party_logs import install as _quiet_third_party_logs

_quiet_third_party_logs()
