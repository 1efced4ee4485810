-- wrk: one single increment of 1 per request (no event id).
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"delta": 1}'
