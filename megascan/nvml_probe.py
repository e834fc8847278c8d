"""GPU clocks, power, temperature and throttle reasons from NVML (nvidia-ml-py), read once per window."""

# NVML's clocks-event (throttle) reason bits, as documented in nvml.h.
_THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


class NvmlProbe:
    def __init__(self, pynvml, handle):
        self.nvml, self.handle = pynvml, handle

    @classmethod
    def open(cls, device_uuid):
        """The probe for the GPU with this UUID, or None where NVML is not available."""
        try:
            import pynvml

            pynvml.nvmlInit()
            return cls(pynvml, pynvml.nvmlDeviceGetHandleByUUID(device_uuid))
        except Exception:  # no library, no driver, no such device: record no NVML evidence
            return None

    def read(self):
        nvml, handle = self.nvml, self.handle
        try:
            reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
            return {
                "sm_clock_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
                "max_sm_clock_mhz": nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM),
                "mem_clock_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM),
                "power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                "temperature_c": nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
                "utilization_pct": nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                "throttle_reasons": [name for bit, name in _THROTTLE_REASONS.items() if reasons & bit],
            }
        except nvml.NVMLError:
            return None
