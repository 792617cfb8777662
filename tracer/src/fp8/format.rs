//! The two FP8 formats and their scalar casts, written from the format
//! definitions (OCP 8-bit floating point, 2023) with PyTorch's conventions
//! for what does not fit. This is the CPU reference the tch path is checked
//! against; both are checked against PyTorch's own casts (golden vectors).
//!
//! Conventions of PyTorch's `float8_e4m3fn` / `float8_e5m2` casts, matched
//! here bit for bit:
//! - rounding is to nearest, ties to even, including into the subnormals;
//! - e4m3fn has no infinity: a value that rounds past 448 (|x| > 464) and
//!   ±Inf become NaN (`0x7F`, sign kept);
//! - e5m2 keeps IEEE semantics: overflow and ±Inf become ±Inf (`0x7C`);
//! - NaN becomes `0x7F` with the input's sign, in both formats.

/// An FP8 format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, no infinities (`float8_e4m3fn`). Max 448.
    E4m3fn,
    /// 5 exponent bits, 2 mantissa bits, IEEE-like (`float8_e5m2`). Max 57344.
    E5m2,
}

impl Fp8Format {
    /// Both formats.
    pub const ALL: [Fp8Format; 2] = [Fp8Format::E4m3fn, Fp8Format::E5m2];

    /// The format's name as PyTorch spells it, without the `float8_` prefix.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Fp8Format::E4m3fn => "e4m3fn",
            Fp8Format::E5m2 => "e5m2",
        }
    }

    /// Largest finite value.
    #[must_use]
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4m3fn => 448.0,
            Fp8Format::E5m2 => 57344.0,
        }
    }

    /// The tch kind of this format.
    #[must_use]
    pub fn kind(self) -> tch::Kind {
        match self {
            Fp8Format::E4m3fn => tch::Kind::Float8e4m3fn,
            Fp8Format::E5m2 => tch::Kind::Float8e5m2,
        }
    }

    fn mantissa_bits(self) -> i32 {
        match self {
            Fp8Format::E4m3fn => 3,
            Fp8Format::E5m2 => 2,
        }
    }

    fn bias(self) -> i32 {
        match self {
            Fp8Format::E4m3fn => 7,
            Fp8Format::E5m2 => 15,
        }
    }

    /// Largest biased exponent of a finite value.
    fn max_biased_exponent(self) -> i32 {
        match self {
            Fp8Format::E4m3fn => 15,
            Fp8Format::E5m2 => 30,
        }
    }

    /// The code of an unrepresentably large magnitude (sign added by the caller).
    fn overflow_code(self) -> u8 {
        match self {
            Fp8Format::E4m3fn => 0x7F,
            Fp8Format::E5m2 => 0x7C,
        }
    }

    /// Rounds `x` to the nearest code of this format.
    #[must_use]
    pub fn encode(self, x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        if x.is_nan() {
            return 0x7F | sign;
        }
        if x.is_infinite() {
            return self.overflow_code() | sign;
        }
        let m = i64::from(self.mantissa_bits());
        let min_exponent = 1 - self.bias();
        let magnitude = f64::from(x.abs());
        if magnitude == 0.0 {
            return sign;
        }
        // The quantum (spacing of representable values) at this magnitude;
        // subnormals share the quantum of the smallest normal binade.
        let exponent = exponent_of(magnitude).max(min_exponent);
        let quantum = 2_f64.powi(exponent - m as i32);
        // Exact: a power-of-two division, and f64 holds every f32 value times 2^k.
        let steps = (magnitude / quantum).round_ties_even() as i64;
        if steps == 0 {
            return sign;
        }
        // `steps` is in [2^m, 2^(m+1)] for normals (2^(m+1) means the
        // rounding carried into the next binade) and below 2^m for subnormals.
        let (biased, mantissa) = if steps < (1 << m) {
            (0, steps)
        } else if steps == 1 << (m + 1) {
            (exponent + 1 + self.bias(), 0)
        } else {
            (exponent + self.bias(), steps - (1 << m))
        };
        if biased > self.max_biased_exponent() {
            return self.overflow_code() | sign;
        }
        let code = ((biased as u8) << self.mantissa_bits()) | mantissa as u8;
        // e4m3fn spends its largest code on NaN: rounding onto it is overflow.
        if self == Fp8Format::E4m3fn && code == 0x7F {
            return 0x7F | sign;
        }
        code | sign
    }

    /// The value of a code of this format. NaN codes decode to the NaN
    /// PyTorch produces, payload included: e4m3fn carries its mantissa bits
    /// into the top of the fp32 mantissa; e5m2 goes through fp16, which sets
    /// the quiet bit.
    #[must_use]
    pub fn decode(self, code: u8) -> f32 {
        let negative = code & 0x80 != 0;
        let sign_bit = u32::from(negative) << 31;
        let bits = i32::from(code & 0x7F);
        let m = self.mantissa_bits();
        let biased = bits >> m;
        let mantissa = bits & ((1 << m) - 1);
        let magnitude = match self {
            Fp8Format::E4m3fn if bits == 0x7F => return f32::from_bits(sign_bit | 0x7FF0_0000),
            Fp8Format::E5m2 if biased == 31 && mantissa == 0 => f32::INFINITY,
            Fp8Format::E5m2 if biased == 31 => {
                return f32::from_bits(sign_bit | 0x7FC0_0000 | ((mantissa as u32) << 21));
            }
            _ if biased == 0 => mantissa as f32 * 2_f32.powi(1 - self.bias() - m),
            _ => (1.0 + mantissa as f32 / (1 << m) as f32) * 2_f32.powi(biased - self.bias()),
        };
        if negative { -magnitude } else { magnitude }
    }
}

/// floor(log2(v)) of a positive finite f64, exactly, from its bits.
fn exponent_of(v: f64) -> i32 {
    let biased = ((v.to_bits() >> 52) & 0x7FF) as i32;
    if biased == 0 {
        // f64 subnormal: far below any FP8 quantum; the caller rounds it to zero.
        -1075
    } else {
        biased - 1023
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_codes_decode_to_their_values() {
        let e4 = Fp8Format::E4m3fn;
        assert_eq!(e4.decode(0x7E), 448.0);
        assert_eq!(e4.decode(0x01), 2_f32.powi(-9), "smallest subnormal");
        assert_eq!(e4.decode(0x08), 2_f32.powi(-6), "smallest normal");
        assert!(e4.decode(0x7F).is_nan() && e4.decode(0xFF).is_nan());
        let e5 = Fp8Format::E5m2;
        assert_eq!(e5.decode(0x7B), 57344.0);
        assert_eq!(e5.decode(0x7C), f32::INFINITY);
        assert_eq!(e5.decode(0xFC), f32::NEG_INFINITY);
        assert_eq!(e5.decode(0x01), 2_f32.powi(-16));
    }

    #[test]
    fn every_finite_code_encodes_back_to_itself() {
        for format in Fp8Format::ALL {
            for code in 0..=255_u8 {
                let v = format.decode(code);
                if v.is_finite() {
                    assert_eq!(
                        format.encode(v),
                        code,
                        "{} code {code:#04x} = {v}",
                        format.name()
                    );
                }
            }
        }
    }

    #[test]
    fn ties_round_to_even_and_overflow_follows_pytorch() {
        let e4 = Fp8Format::E4m3fn;
        // 1 + 1/16 lies halfway between 1 (mantissa 000) and 1.125 (001): to even.
        assert_eq!(e4.encode(1.0625), e4.encode(1.0));
        // 1.1875 lies halfway between 1.125 (001) and 1.25 (010): to even.
        assert_eq!(e4.encode(1.1875), e4.encode(1.25));
        assert_eq!(
            e4.encode(464.0),
            0x7E,
            "halfway to the NaN code: to even, 448"
        );
        assert_eq!(e4.encode(465.0), 0x7F, "past it: NaN");
        assert_eq!(e4.encode(-1e9), 0xFF);
        assert_eq!(e4.encode(f32::INFINITY), 0x7F);
        let e5 = Fp8Format::E5m2;
        assert_eq!(
            e5.encode(61440.0),
            0x7C,
            "halfway to 2^16, odd mantissa: up, to Inf"
        );
        assert_eq!(e5.encode(61439.0), 0x7B);
        assert_eq!(e5.encode(f32::NEG_INFINITY), 0xFC);
        assert_eq!(e5.encode(-f32::NAN), 0xFF);
    }
}
